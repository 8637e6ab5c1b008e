import os
import sys

# spawned ranks import test modules by name: make tests/ importable for them
sys.path.insert(0, os.path.dirname(__file__))
