"""``python -m hf_speedup.bench``: the same as ``hf-speedup bench``."""

import sys

from .cli import main

sys.exit(main())
