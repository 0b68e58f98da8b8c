"""What every benchmark reports: the definitions (`metrics`: TTFT, ITL, goodput under the SLO),
result files, plots and tables (`report`, `bench report`), and means over seeds (`seedmeans`,
`bench seeds`).
"""
