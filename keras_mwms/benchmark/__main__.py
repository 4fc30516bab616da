"""`python -m keras_mwms.benchmark` — see `keras_mwms.benchmark`."""

import sys

from keras_mwms.benchmark.command import main

sys.exit(main())
