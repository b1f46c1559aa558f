from services.estimator.service import add_arguments, start
from services.runner import service_main

service_main("estimator", start, add_arguments)
