"""Cross-replica sync: what each EPP replica tells the others about its own routing decisions."""
