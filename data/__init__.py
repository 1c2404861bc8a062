"""tpfuse.data"""
