from services.node.agent import add_arguments, start
from shared.runner import service_main

service_main("node", start, add_arguments)
