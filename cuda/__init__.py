"""weftboard."""
