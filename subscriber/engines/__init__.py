"""Engine adapters: the port (``base.EngineAdapter``), one module per engine, and the
registry that picks one by name (``factory.make_adapter``)."""
