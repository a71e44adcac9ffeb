"""Private and version-dependent JAX, flax and Orbax names, each fenced with a public fallback."""
