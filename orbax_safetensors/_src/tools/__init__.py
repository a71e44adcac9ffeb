"""Inspection, diff, verify, convert, the CLI and the demo (the top layer)."""
