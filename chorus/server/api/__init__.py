"""The API surfaces, one module or sub-package each (server/app.py lists their routers); each route runs
resolve, plan, reply (server/resolve.py, plan.py, reply.py)."""
