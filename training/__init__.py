"""tpfuse.training"""
