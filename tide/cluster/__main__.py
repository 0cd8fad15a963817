"""`python -m tide.cluster`: submit TIDE as one Slurm het job (see tide.cluster.submit)."""

import sys

from tide.cluster.submit import main

sys.exit(main())
