"""tpfuse.kernels"""
