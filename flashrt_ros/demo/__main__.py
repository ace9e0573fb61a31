"""``python -m flashrt_ros.demo`` (also ``make demo``)."""

import sys

from flashrt_ros.demo.cli import main

sys.exit(main())
