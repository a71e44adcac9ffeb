"""Object storage (``s3://``, ``gs://``): write engines and a ranged-read engine behind
:mod:`orbax_safetensors._src.storage.router`.

The router stays the single entry point: its scheme registry maps ``s3`` and ``gs`` to the
providers of :mod:`.engine` (``open_reader``, ``write_file``, and the two checkpoint hooks
``prepare_directory`` / ``finalize_directory``). Orbax's rules for object storage (the commit
scheme, manager options) are :mod:`orbax_safetensors._src.orbax.object_storage`.

The modules, lowest first:
  * :mod:`.options` (``ObjectStoreOptions``), :mod:`.stats` (``ObjectStoreStats``);
  * :mod:`.calls`: ``ObjectStoreError``, retries, tracing and the shared request pool;
  * :mod:`.views`: upload bodies and download sinks over memoryviews, request splitting;
  * :mod:`.common`: what every provider shares (URLs, the ``Store`` protocol,
    ``ObjectReader``, staged objects, downloading object ranges);
  * :mod:`.s3` and :mod:`.gcs`: one module per provider (its client, its multipart or compose
    requests, how it joins the ranges of several processes);
  * :mod:`.upload_plan` and :mod:`.upload_requests`: the pure plan of a save by several
    processes (part windows, their builders, compose trees; every process's requests);
  * :mod:`.spread`: executes this process's part of that plan (``jax.distributed`` jobs);
  * :mod:`.engine`: the provider-neutral write flow, and the providers the router registers.

Clients: boto3 for S3 and google-cloud-storage for GCS, used directly (not fsspec). They speak
every request the engines need as public API (multipart upload with caller-chosen part numbers
under a shared UploadId, UploadPartCopy with a byte range, GCS compose), are thread-safe enough to
run a bounded pool of requests in flight, and let this package own retries and byte counting.
They read the same configuration as ``etils.epath`` (environment variables; for S3 also the
endpoint and keys in ``fsspec.config.conf["s3"]``).

Writes:
  * One writer holding every byte of a file (``save_file``, single-process checkpoints): the final
    object is written directly and appears whole or not at all (S3: one PUT, or a multipart
    upload of ``part_size`` parts in parallel; GCS: one upload, or parallel staged objects
    composed into the final object).
  * Several processes filling one file in a ``jax.distributed`` job: the spread plan
    (:mod:`.spread`): each process uploads its own bytes and builds the part windows the plan
    gives it; the primary only completes the uploads or composes the top level.
  * Several processes filling one file without the key-value store (the earlier flow):
    each process uploads only its own contiguous byte ranges under the hidden prefix
    ``<dir>/.osf-parts/<file>/`` plus a small manifest; the primary's ``finalize_directory``
    joins them. GCS: ranges are staged objects, composed in offset order (<= 32 sources per call,
    in a tree). S3: one multipart upload per file, created by the primary before anyone writes
    (ids broadcast to every process with ``compat.multihost.broadcast_bytes``); each process
    uploads the interior of its large ranges straight into that upload as parts numbered by
    offset; its small ranges and the first and last 5 MiB of each large range go into one
    "loose" object, from which the primary builds the remaining parts (UploadPartCopy when a
    range is >= 5 MiB, download and upload otherwise) so that every part but the last is
    >= 5 MiB. See ``docs/object-storage.md``.

Reads: ``ObjectReader.read_runs`` groups the wanted runs into ranges that fetch at most 1.5x the
wanted bytes in the fewest requests (gaps merged smallest first, none over ``max_gap``:
``core.runs.ranged_reads``), splits the result into HTTP range requests of <= ``max_request_bytes`` and runs at
most ``max_in_flight`` of them at once, streaming each body into the caller's buffers.

Every request is retried on transient failures (HTTP 5xx/429/408, timeouts, connection resets)
up to ``max_attempts`` times with exponential backoff; other failures raise ``ObjectStoreError``
at once, naming the URL and the operation.

Example::

    with router.open_reader("s3://bucket/ckpt/model.safetensors") as r:
        head = r.pread(0, 8)
    print(stats.object_store_stats().bytes_fetched)
"""
