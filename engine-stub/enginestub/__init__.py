"""The engine stub: emulated NPU dies, UB/RoCE/VPC fabric, serving timings and node emulation.

It lets the MatrixServe control plane run and be measured without NPUs (SYSTEM.md §4-5).
"""

__version__ = "0.1.0"
