"""tpfuse.pipeline"""
