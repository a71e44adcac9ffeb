"""Orbax integration: the handler and args, Orbax's directory conventions, object-storage rules."""
