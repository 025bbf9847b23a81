"""Makes kvrouter_client importable when an example runs from a checkout (clients/python)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
