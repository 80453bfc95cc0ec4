"""``python -m fa_lab``: the ``fa-lab`` command."""
import sys

from fa_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
