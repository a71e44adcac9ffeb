"""Pure building blocks: errors, dtypes, the safetensors header, checksums, sharding memos."""
