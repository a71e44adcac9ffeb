"""The implementation of ``orbax_safetensors``; users import the package root only.

Each folder is a layer that imports only the layers below it (highest first):

- ``tools``: inspection, diff, verify, convert, the CLI and the demo;
- ``integrations``: NNX and PyTorch / Hugging Face;
- ``catalog``: any checkpoint as a table of tensors;
- ``orbax``: the Orbax handler and args, Orbax's directory conventions, object-storage rules;
- ``pipeline``: save and restore (standalone files and checkpoint directories);
- ``storage``: moving bytes to and from local files and object stores;
- ``core``: pure building blocks (no I/O, no threads, no Orbax);
- ``compat``: private and version-dependent JAX, flax and Orbax names.
"""
