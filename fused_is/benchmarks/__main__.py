"""`python -m fused_is.benchmarks`: `fused-is bench` (fused_is.benchmarks.main)."""

import sys

from .main import main

sys.exit(main())
