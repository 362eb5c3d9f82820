"""What every benchmark shares: processes (ports, trees, RSS, CPU time), a server started and
waited for, the arm loop, percentiles and tables, guided tables. It imports no benchmark."""
