"""Video files to backbone inputs: decord reading (`video`) and input building (`inputs`).

Sits between the core (`hippo`) and the adapters: adapters build their inputs with its helpers, and
`Pipeline.video_inputs` reaches it through the `hippo_video_inputs` hook (`hippo.media.plugin`).
"""
