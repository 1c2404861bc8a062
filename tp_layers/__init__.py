"""tpfuse.tp_layers"""
