import os
import sys

# Test folders share helpers (tests/reference.py); pytest only puts each test's own folder
# on the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
