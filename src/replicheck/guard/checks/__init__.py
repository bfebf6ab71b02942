"""The checks, each with its finding: gradient health, replica votes, the reduce-scatter sketch,
the optimizer-update replay, and the loss scaler's overflows."""
