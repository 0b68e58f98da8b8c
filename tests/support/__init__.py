"""Scaffolding shared by the test packages: the gateway's configuration files
(`gateway_files`), `poolkeeper serve`/`sim` as subprocesses (`processes`), and a simulated
model server with the gateway runtime in the test's own process (`sim_gateway`)."""
