"""The command-line front end: argument parsing, secrets, daemonising, exit codes."""
