"""What the benchmarks and the end-to-end tests share: processes (ports, trees, RSS, CPU
time), a server started and waited for, client patterns (bursts, stalled and vanishing
clients), the compose roles as local processes, the arm loop, percentiles and tables, guided
tables, one read of a server's /metrics.  It imports no benchmark, so tests take their
process helpers from here."""
