from train.main import exit_cleanly, main

# Everything is written and committed by now (main() tears the process group down itself).
exit_cleanly(main())
