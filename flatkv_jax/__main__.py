"""``python -m flatkv_jax``: the ``flatkv`` command line (:mod:`flatkv_jax.cli`)."""

import sys

from flatkv_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
