"""Plain-client access to the local buckets (boto3 / google-cloud-storage), never through this
library, so that the object-storage tests check what the library wrote.
"""

from __future__ import annotations

from typing import Any

from . import servers


def split_url(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def download(server: servers.ObjectStoreServer, url: str) -> bytes:
    """The object's bytes through the vendor client (boto3 / google-cloud-storage)."""
    bucket, key = split_url(url)
    if server.kind == "s3":
        return servers.s3_client(server).get_object(Bucket=bucket, Key=key)["Body"].read()
    from google.cloud import storage

    return storage.Client().bucket(bucket).blob(key).download_as_bytes()


def upload(server: servers.ObjectStoreServer, url: str, data: bytes) -> None:
    """Writes an object through the vendor client."""
    bucket, key = split_url(url)
    if server.kind == "s3":
        servers.s3_client(server).put_object(Bucket=bucket, Key=key, Body=data)
        return
    from google.cloud import storage

    storage.Client().bucket(bucket).blob(key).upload_from_string(data)


def list_keys(server: servers.ObjectStoreServer, url: str) -> list[str]:
    """Every object key under ``url`` (a bucket or a prefix), relative to it."""
    bucket, prefix = split_url(url)
    prefix = f"{prefix.rstrip('/')}/" if prefix else ""
    if server.kind == "s3":
        pages = servers.s3_client(server).get_paginator("list_objects_v2")
        keys = [
            o["Key"]
            for p in pages.paginate(Bucket=bucket, Prefix=prefix)
            for o in p.get("Contents", [])
        ]
    else:
        from google.cloud import storage

        keys = [b.name for b in storage.Client().list_blobs(bucket, prefix=prefix)]
    return sorted(k[len(prefix) :] for k in keys)


def pending_uploads(server: servers.ObjectStoreServer, url: str) -> list[Any]:
    if server.kind != "s3":
        return []
    bucket, _ = split_url(url)
    return servers.s3_client(server).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
