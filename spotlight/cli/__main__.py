from spotlight.cli import main

main()
