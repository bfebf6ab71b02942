"""Who is to blame: findings and votes, the verification ring, arbitration and re-runs."""
