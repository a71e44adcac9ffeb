"""Object storage (``s3://``, ``gs://``) behind ``storage.router``: requests and retries
(:mod:`.calls`), what every provider shares (:mod:`.common`), one module per provider
(:mod:`.s3`, :mod:`.gcs`), the pure plan of a save by several processes (:mod:`.upload_plan`),
one process's part of it over ``jax.distributed``'s key-value store (:mod:`.spread`), and the
write flow with the providers the router registers (:mod:`.engine`). ``docs/object-storage.md``
tells the whole story.

Example::

    with router.open_reader("s3://bucket/ckpt/model.safetensors") as r:
        head = r.pread(0, 8)
    print(calls.object_store_stats().bytes_fetched)
"""
