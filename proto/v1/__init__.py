"""Generated gRPC stubs of weftboard.v1 (see proto/generate.py)."""
