import sys

from spotlight.workers.eval.eval_worker import main

sys.exit(main())
