"""Object storage (``s3://``, ``gs://``) behind ``storage.router``: what every provider shares
(requests, retries, counters, ranged reads: :mod:`.common`), one module per provider
(:mod:`.s3`, :mod:`.gcs`), the pure plan of a save by several processes (:mod:`.upload_plan`),
one process's part of it (:mod:`.spread`), and the write flow with the providers the router
registers (:mod:`.engine`). ``docs/object-storage.md`` tells the whole story.
"""
