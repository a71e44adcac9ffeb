"""The ``orbax-safetensors`` console script (the implementation is ``_src/tools/cli.py``).

Example::

    python -m orbax_safetensors.cli inspect /ckpt
"""

import sys

from orbax_safetensors._src.tools.cli import (
    EXIT_DIFFERENT,
    EXIT_ERROR,
    EXIT_OK,
    build_parser,
    main,
    parse_size,
)

__all__ = ["EXIT_DIFFERENT", "EXIT_ERROR", "EXIT_OK", "build_parser", "main", "parse_size"]

if __name__ == "__main__":
    sys.exit(main())
