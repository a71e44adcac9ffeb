"""Object storage (``s3://``, ``gs://``): write engines and a ranged-read engine behind
:mod:`orbax_safetensors._src.storage.router`, whose scheme registry maps ``s3`` and ``gs`` to the
providers of :mod:`.engine`. Orbax's rules for object storage (the commit scheme, manager
options) are :mod:`orbax_safetensors._src.orbax.object_storage`.

The modules, lowest first:
  * :mod:`.calls`: ``ObjectStoreError``, retries, the shared request pool, ``ObjectStoreStats``;
  * :mod:`.common`: what every provider shares (URLs, the ``Store`` protocol of a client,
    ``ObjectReader``, bytes as memoryviews, the hidden prefix of temporary objects);
  * :mod:`.s3` and :mod:`.gcs`: one module per provider (its client, its multipart upload or
    parallel composite upload);
  * :mod:`.upload_plan`: the pure plan of a save by several processes (part windows, their
    builders, loose bundles, compose trees);
  * :mod:`.spread`: one process's part of that plan, over ``jax.distributed``'s key-value store;
  * :mod:`.engine`: the provider-neutral write flow (one writer, or a save by several
    processes: register, finish, commit, clean up) and the providers the router registers.

The clients are boto3 and google-cloud-storage, used directly (not fsspec): they speak every
request the engines need as public API, run from a bounded pool of requests in flight, and let
this package own retries and byte counting. They read the same configuration as
``etils.epath`` (environment variables; for S3 also the endpoint and keys in
``fsspec.config.conf["s3"]``).

A file one process holds whole is written directly and appears whole or not at all. A file
several processes of a ``jax.distributed`` job fill is written by the spread plan: each process
uploads its own bytes and builds the part windows the plan gives it; the primary only commits.
A job of several processes without the key-value store is refused with an error naming what is
missing. Reads fetch at most 1.5x the wanted bytes in the fewest ranged GETs. Every request is
retried on transient failures. ``docs/object-storage.md`` tells the whole story.

Example::

    with router.open_reader("s3://bucket/ckpt/model.safetensors") as r:
        head = r.pread(0, 8)
    print(calls.object_store_stats().bytes_fetched)
"""
