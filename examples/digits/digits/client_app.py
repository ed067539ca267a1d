"""ClientApp: the client's own data and training loop; fedfusion only reads the server's
initial models and builds the reply."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from digits.task import client_data, model_fn, train
from fedfusion import client

app = ClientApp()


@app.train()
def train_members(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    config = context.run_config
    x, y = client_data(partition, int(context.node_config["num-partitions"]),
                       float(config["alpha"]), int(config["seed"]))
    models = client.initial_models(msg, model_fn(config), x)  # fedfusion glue 1/2
    for m, model in enumerate(models):
        train(model, x, y, int(config["local-epochs"]), seed=1000 * partition + m)
    return client.reply(msg, models, x, y, client_id=partition)  # fedfusion glue 2/2
