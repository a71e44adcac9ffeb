"""Moving bytes to and from local files, object stores and other epath backends."""
