"""What the domains' commands share, below every domain: exit codes and one-line errors
(console), the CLI's input files and options (inputs), and the CI reports of the gates
(gate_reports). The `lsa` app itself and the registration of each domain's commands are
service.cli's, at the top."""
