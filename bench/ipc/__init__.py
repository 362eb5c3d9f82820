"""`tandem bench ipc`: the shared-memory ring against ZeroMQ (`main.py`, `echo.py`)."""
