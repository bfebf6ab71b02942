"""What crosses ranks and how: the collectives, packed messages, typed records, host transfers."""
