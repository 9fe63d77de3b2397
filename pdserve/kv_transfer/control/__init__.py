"""Control plane: the typed wire protocol (messages) and its ZeroMQ transport (messenger)."""
