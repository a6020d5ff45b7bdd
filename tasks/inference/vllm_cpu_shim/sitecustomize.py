"""Loaded by vLLM's interpreter (PYTHONPATH) only when serving Qwen3.5 on CPU.

The PyPI torchvision 0.28.0 wheel is a CUDA build: its C++ ops cannot load
against torch 2.13.0+cpu, and then its module `_meta_registrations` fails on
import (it registers fake kernels for ops that were never defined). vLLM only
needs torchvision's pure-Python image transforms to import, never its ops, so
that one module is replaced by an empty one before torchvision is imported.
"""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
