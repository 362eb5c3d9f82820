"""`tandem bench robustness`: overload, stalled and vanishing clients, role restarts."""
