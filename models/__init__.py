"""tpfuse.models"""
