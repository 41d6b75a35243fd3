from trajbus.cli import main

main()
