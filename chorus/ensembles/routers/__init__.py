"""The ``route`` strategy's routers, one module each, found through their registry (routers/base.py): how a router
checks its parameters, warms up and picks the member that answers."""
