"""The engine's side of the KV exchange: rank 0 decides what moves (exchange.py), every rank applies
its commands through its transceiver (connector.py) over the typed rank wire (wire.py), and the KV
events publisher (events.py) tells routers which prefixes this instance caches."""
