"""The process among ranks: the process group, the console, stop signals, the elastic relaunch."""
